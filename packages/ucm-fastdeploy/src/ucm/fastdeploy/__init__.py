"""UCM for FastDeploy.

Coming: the AttentionStore and KVCacheStorage backends; nothing is implemented yet.
"""
