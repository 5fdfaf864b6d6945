"""The proxy: reads a request, forwards it to the backend the router chooses, relays the
answer (`forward`), over a transport behind `upstream.Upstream`; `shadow` sends the goodput
policy's shadow probes."""
