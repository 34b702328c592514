"""The pure core: identity, hashing, the claim's decisions, the settlement, the
consumer's settings and the errors. It imports no framework and no database driver."""
