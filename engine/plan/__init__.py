"""Stage 2, the plan: tokenizing (with the token cache by content), KV block hashes, the global prefix
tree and its groups, identical rows, shards, the prepared batch and the plan file."""
