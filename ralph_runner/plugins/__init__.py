"""What the action and probe kinds build on: their discovery, their parameters' field types,
and what a failed request or connection means."""
