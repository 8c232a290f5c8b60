# clients.mk: the Go client (clients/go) and the CLI (cmd/deltagym). Their integration tests and
# runnable examples run against an in-process server on the default image, so `make test`
# builds it first (they skip, saying why, when it is missing).
TEST_PREREQS += image
