"""dspark-sim: simulate speculative-decoding verification policies before deployment.

The top-level folders of the repository (``sim/``, ``policies/``, ``traces/``,
``calibration/``, ``kernels/``) are mapped by the build backend into this one
namespace, so ``dspark_sim.kernels`` never shadows Hugging Face's ``kernels``.
"""

__version__ = "0.1.0"

# set in the environment where the command line chose OpenBLAS's thread count itself
# (``dspark_sim.cli.single_threaded_blas``), so that the processes it starts for other
# programs (vLLM's servers and client) get their own default back
BLAS_DEFAULTED_ENV = "DSPARK_SIM_BLAS_DEFAULTED"
