import torch, time
torch.set_num_threads(1)
from specdec import linear
lin = torch.nn.Linear(576, 1536, bias=False)
p = linear.PackedLinear(lin)
xs = {m: torch.randn(m, 576) for m in range(1, 65)}
with torch.inference_mode():
    for m in range(1, 65): p(xs[m])
    t = time.perf_counter()
    for r in range(10):
        for m in range(1, 65): p(xs[m])
    print('per call us', round((time.perf_counter() - t) / 640 * 1e6, 1))
