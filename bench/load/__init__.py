"""Load testing: drive the router at a target concurrency or arrival rate, simulated or real workers."""
