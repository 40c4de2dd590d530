"""Real-vs-simulated validation: the room above sim/, traces/ and calibration/.

``server.py`` is a real continuous-batching speculative-decoding server (torch) on the
CPU target; ``harness.py`` runs it and the simulator on the same workload and compares
them. Nothing below this room imports it: sim/ stays free of torch.
"""

if "." not in __name__:  # the bare folder name, from a sys.path entry at the checkout's root
    from dspark_sim.shadow import defer_to_installed

    defer_to_installed(__name__, __file__)
