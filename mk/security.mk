# security.mk: the security suite (server/securitytest: attacks run from inside sandboxes and
# through the API of a real server, docs/SECURITY.md) and the fuzz targets of the code that
# parses untrusted input. `make test` runs both: the suite is part of `go test ./...`, and each
# fuzz target's seed corpus (its package's testdata/fuzz) runs as a plain test. `make fuzz`
# fuzzes each target for FUZZTIME; an input that fails is written to its package's
# testdata/fuzz, where the next `go test` runs it.
FUZZTIME ?= 30s
# package:target, one per fuzz target.
FUZZ_TARGETS := \
	./server:FuzzRequestDecode \
	./server:FuzzImportRoot \
	./server:FuzzParseBytes \
	./server/ledger:FuzzParseFrame \
	./envpool:FuzzParseSpec \
	./envpool:FuzzSpecRoundTrip \
	./sandbox:FuzzFilePath \
	./sandbox/image:FuzzCleanEntryName
FUZZ_PKGS := $(sort $(foreach t,$(FUZZ_TARGETS),$(firstword $(subst :, ,$(t)))))

.PHONY: test-security fuzz

test-security: deps postgres image $(BIN)/dg-init ## the security suite (attacks on a real server, each refused while a canary sandbox answers) and the fuzz corpora (as root)
	DELTAGYM_INIT=$(BIN)/dg-init go test -count=1 -timeout 20m ./server/securitytest/
	DELTAGYM_INIT=$(BIN)/dg-init go test -count=1 -timeout 10m -run '^Fuzz' $(FUZZ_PKGS)

fuzz: deps $(BIN)/dg-init ## fuzz each target for FUZZTIME (30s); failing inputs land in the package's testdata/fuzz
	@failed=; for t in $(FUZZ_TARGETS); do pkg=$${t%%:*}; name=$${t#*:}; \
		echo "fuzz: $$name ($$pkg) for $(FUZZTIME)"; \
		DELTAGYM_INIT=$(BIN)/dg-init go test -run '^$$' -fuzz "^$$name\$$" -fuzztime $(FUZZTIME) $$pkg || failed="$$failed $$name"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: failed:$$failed (the inputs are in testdata/fuzz of their packages)" >&2; exit 1; fi
