"""Command-line tools: `shoal run`, `shoal bench`."""
