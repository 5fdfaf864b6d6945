"""Prefix and session affinity: keys from the request (`keys`), what was routed where
(`index`, `tracker`), and what a cached prefix is worth against load (`pricing`)."""
