# clients.mk: the Go client (clients/go, a module of its own) and the CLI (cmd/deltagym). The
# client's integration tests and runnable examples run against bin/deltagym serve on the default
# image, the CLI's against an in-process server, so `make test` builds both first (the tests skip,
# saying why, when one is missing).
TEST_PREREQS += image
