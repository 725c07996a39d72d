"""analyses package."""
