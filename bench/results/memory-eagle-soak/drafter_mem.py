"""Does the eagle drafter's RSS grow per request while its live tensors stay constant? (leak vs heap)"""
import ctypes, gc, random, sys, time
import torch
from specdec.drafters.base import DraftConfig
from specdec.drafters.eagle import EagleDrafter
from specdec.sampling import SamplingParams
from specdec.sampling import make_generator
torch.set_num_threads(1)
trim = ctypes.CDLL(None).malloc_trim
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
def live_tensor_mb():
    total = 0
    for o in gc.get_objects():
        try:
            if torch.is_tensor(o): total += o.untyped_storage().nbytes()
        except Exception: pass
    return total / 2**20
d = EagleDrafter.load(__import__("pathlib").Path(sys.argv[1]), DraftConfig(num_draft_tokens=4, tree_width=1), hidden_size=576, vocab_size=49152)
W = d.feature_width
rng = random.Random(0)
params = SamplingParams(temperature=0.7)
for i in range(int(sys.argv[2])):
    n = rng.choice([40, 90, 300, 900, 1500, 2500])
    prompt = [rng.randrange(100, 40000) for _ in range(n)]
    h = d.open(prompt, params, make_generator(i))
    d.add_features(h, 0, torch.randn(n - 1, W))
    for r in range(rng.randrange(5, 40)):
        (p,) = d.propose([h], [4])
        k = rng.randrange(1, 3)
        emitted = [rng.randrange(100, 40000) for _ in range(k)]
        L = len(d.text(h)) if hasattr(d, 'text') else None
        d.add_features(h, L - 1, torch.randn(k, W))
        d.sync(h, L, emitted)
    d.close(h)
    if i % 25 == 0:
        gc.collect()
        before = rss(); trim(0); after = rss()
        print(f"{i:4d} rss {before:7.1f} trimmed {after:7.1f} live tensors {live_tensor_mb():7.1f} MiB objects {len(gc.get_objects())}", flush=True)
