"""The runbook language: YAML with positions, the schema, templating, inventory, the plan."""
