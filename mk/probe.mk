# The process-shape probe (sandbox/testdata/probe/probe.c): a static C program that the sandbox
# tests copy into sandboxes (TestProcessShapes); built like the init.
.PHONY: probe

$(BIN)/dg-probe: sandbox/testdata/probe/probe.c | $(BIN)
	$(CC) -O2 -static -pthread -Wall -Wextra -Werror -o $@ $<

probe: $(BIN)/dg-probe ## build the process-shape probe the sandbox tests copy into sandboxes

TEST_PREREQS += $(BIN)/dg-probe
test-privileged: $(BIN)/dg-probe
