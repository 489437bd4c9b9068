"""Egress for sandboxes: the policy, the secrets, and the proxy that enforces them (docs/egress.md)."""
