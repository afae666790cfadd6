"""Torch runs single-threaded in these tests: the tiny model gains nothing from threads, and on
a loaded 2-core CI box oversubscribed torch threads made them 10-50x slower."""

import torch

torch.set_num_threads(1)
