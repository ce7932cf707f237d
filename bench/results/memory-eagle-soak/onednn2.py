import sys, torch, gc
torch.set_num_threads(1)
from specdec import linear
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
lin = torch.nn.Linear(576, 8192, bias=False)
mode = sys.argv[1]
p = linear.PackedLinear(lin) if mode == 'packed' else lin
sizes = list(range(1, 401)) if sys.argv[2] == 'vary' else [37] * 400
print(mode, sys.argv[2], 'start', round(rss()))
for i, m in enumerate(sizes, 1):
    with torch.inference_mode():
        y = p(torch.randn(m, 576))
    del y
    if i % 100 == 0: print(i, round(rss()), flush=True)
import ctypes; ctypes.CDLL(None).malloc_trim(0); print('trimmed', round(rss()))
