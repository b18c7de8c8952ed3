"""The runbook, assembled from the action and probe kinds: YAML with positions, the schema, the
loader, inventory, the plan, the tasks."""
