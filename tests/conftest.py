"""Test-wide settings."""

import torch

# The tests drive tiny models where intra-op threading costs more than it saves (10x on two cores).
torch.set_num_threads(1)
