"""specfw: speculative-decoding LLM inference.

MKL's conditional numerical reproducibility is switched on here, before anything can start MKL
(it reads ``MKL_CBWR`` once, at its first call): without it MKL's sgemm rounds by the memory
alignment of its operands on some CPUs (measured on AMD EPYC: fp32 SDPA rows computed by the
second OpenMP thread, whose scratch buffer sits elsewhere, differ in the last bits), which
breaks batch-invariant decoding. A value set by the user wins.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO")
