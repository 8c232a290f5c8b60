# Images: the default sandbox image rootfs that `make run` uses and the services image of the
# process-shape tests (each built once, then cached).
DEPS_GROUPS += image

.PHONY: image

IMAGE_ROOTFS := $(DATA)/images/default/rootfs

image: $(IMAGE_ROOTFS)/.deltagym-image-stamp $(IMAGE_ROOTFS)/.deltagym-identity-stamp ## build the default image rootfs (Debian bookworm minbase + python3, git, procps; cached)

$(IMAGE_ROOTFS)/.deltagym-image-stamp:
	@./scripts/build-default-image.sh $(IMAGE_ROOTFS)

# A cached image gets the sandbox's identity too (image-identity.sh is idempotent), whenever
# the script is newer than the image's last pass.
$(IMAGE_ROOTFS)/.deltagym-identity-stamp: scripts/image-identity.sh $(IMAGE_ROOTFS)/.deltagym-image-stamp
	@./scripts/image-identity.sh $(IMAGE_ROOTFS)
	@touch $@

# The services image: the default image's packages with Debian's postgresql-15, redis-server and
# nodejs, built by the same script into a directory of its own (the default image is untouched),
# for the service rows of the sandbox's process-shape tests. `make test` builds it first; the
# tests skip, saying why, without it.
.PHONY: image-services
TEST_PREREQS += image-services

SERVICES_ROOTFS := $(DATA)/images/services/rootfs

image-services: $(SERVICES_ROOTFS)/.deltagym-image-stamp $(SERVICES_ROOTFS)/.deltagym-identity-stamp ## build the services image rootfs (the default image's packages + postgresql-15, redis-server, nodejs; cached)

$(SERVICES_ROOTFS)/.deltagym-image-stamp:
	@./scripts/build-default-image.sh $(SERVICES_ROOTFS) services

$(SERVICES_ROOTFS)/.deltagym-identity-stamp: scripts/image-identity.sh $(SERVICES_ROOTFS)/.deltagym-image-stamp
	@./scripts/image-identity.sh $(SERVICES_ROOTFS)
	@touch $@

# The services' rollback benchmarks (BenchmarkRollbackPostgres, -Redis, -Node), verbose so that a
# benchmark skipped says why (docs/PERFORMANCE.md, "Services").
.PHONY: bench-services
BENCH_TARGETS += bench-services

bench-services: deps $(BIN)/dg-init criu image-services ## service rollbacks (Postgres, Redis, Node): the default process mode against criu, p50/p99 and server CPU per rollback
	DELTAGYM_INIT=$(BIN)/dg-init go test -run '^$$' -bench 'RollbackPostgres|RollbackRedis|RollbackNode' -benchtime 50x -v -timeout 30m ./sandbox/
