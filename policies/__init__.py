"""policies."""

if "." not in __name__:  # the bare folder name, from a sys.path entry at the checkout's root
    from dspark_sim.shadow import defer_to_installed

    defer_to_installed(__name__, __file__)
