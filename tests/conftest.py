import os
import sys

import torch

# Tests spawn workers; one thread each keeps 2 cores from thrashing.
torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
