"""steplens reports: HTML and markdown."""
