"""HTTP routes: info (models, health, version, metrics), completions, chat."""
