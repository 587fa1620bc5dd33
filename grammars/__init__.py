"""Shipped grammars (.lark / .ebnf), read with `importlib.resources.files("structgen.grammars")`."""
