"""The marker plugins decorate their hook functions with."""

import pluggy

hookimpl = pluggy.HookimplMarker("nexrl")
