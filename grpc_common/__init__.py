"""gRPC glue shared by the services: proto <-> core conversions, error mapping, server lifecycle."""
