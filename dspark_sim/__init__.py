"""dspark-sim: simulate speculative-decoding verification policies before deployment.

The top-level folders of the repository (``sim/``, ``policies/``, ``traces/``,
``calibration/``, ``kernels/``) are mapped by the build backend into this one
namespace, so ``dspark_sim.kernels`` never shadows Hugging Face's ``kernels``.
"""

__version__ = "0.1.0"
