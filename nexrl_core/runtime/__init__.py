"""What every module shares whatever the launch mode: ``execute``, the module base and its
thread lifecycle, activity tracking."""
