"""Real-vs-simulated validation: the room above sim/, traces/ and calibration/.

``server.py`` is a real continuous-batching speculative-decoding server (torch) on the
CPU target; ``harness.py`` runs it and the simulator on the same workload and compares
them. Nothing below this room imports it: sim/ stays free of torch.
"""
