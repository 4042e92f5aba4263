"""What a recipe may hold: every key declared once, with its type, default and help.

- :mod:`.options`: ``Option``, a component's declared recipe keys (type, default, range, help)
- :mod:`.settings`: ``Settings``, typed settings classes (the one declaration of a section's keys);
  ``read_section``: a component's section as it reads it (a copy, declared defaults filled)
- :mod:`.schema`: the core's own keys, as Settings classes (``RecipeSettings``: the whole recipe); ``core_defaults()``

This folder imports nothing above it: composing and checking a recipe is ``launch/``'s.
"""
