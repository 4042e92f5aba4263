"""What a recipe may hold: every key declared once, with its type, default and help.

- :mod:`.options`: ``Option``, a component's declared recipe keys (type, default, range, help)
- :mod:`.schema`: the core's own keys, declared with ``Option``; ``core_defaults()``
- :mod:`.bound`: a component's section bound to its declarations (defaults filled, undeclared reads refused)
- :mod:`.migration_table`: NexRL/ROLL keys and what each became (``nexrl migrate``, hints for old keys)

This folder imports nothing above it: composing and checking a recipe is ``launch/``'s.
"""
