"""UCM for FastDeploy (coming: the AttentionStore and KVCacheStorage backends; nothing is implemented yet)."""
