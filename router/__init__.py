"""The router: client-facing gRPC (``specdec.v1.Router``) and OpenAI-compatible HTTP, the per-request round
pipeline over remote drafters and verifiers, and the placement of requests on them (DESIGN §2, §4, §5)."""
