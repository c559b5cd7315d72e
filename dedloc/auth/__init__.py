"""Membership: who may take part in a run (invitations, revocations), and the checks that enforce it
on every stream, DHT request and record. See docs/security.md."""
