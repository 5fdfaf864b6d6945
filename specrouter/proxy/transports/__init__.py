"""HTTP clients behind `specrouter.proxy.upstream.Upstream`: `native` (the default) and
`httpx`, chosen by `upstream.transport`."""
