"""A thinking model's reasoning: its tags (config.py), the servers' text split (parsers.py)
and the engine's gate on its tokens (gate.py: thinking budgets, grammars after it)."""
