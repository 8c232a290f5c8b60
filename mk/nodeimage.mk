# nodeimage.mk: the container image of a deltagym node (docs/NODE-IMAGE.md), an OCI image
# layout in $(NODE_IMAGE_OCI) tagged with VERSION, built without a container engine: a Debian
# bookworm root by mmdebstrap (scripts/build-default-image.sh OUT node), the private CRIU and
# PostgreSQL 17 relocated to /opt/deltagym (scripts/node-programs.sh) and the default sandbox
# image in a base layer; a static deltagym, dg-init and envs/ in a small top layer; layers and
# layout written by scripts/ocilayout. Each piece is cached, so a new build of the server
# writes the top layer alone.
DEPS_GROUPS += image postgres

.PHONY: node-image

NODE_IMAGE_DIR := $(DATA)/images/node
NODE_ROOTFS := $(NODE_IMAGE_DIR)/rootfs
NODE_PROGRAMS := $(NODE_IMAGE_DIR)/programs
NODE_LAYERS := $(NODE_IMAGE_DIR)/layers
NODE_IMAGE_OCI := $(NODE_IMAGE_DIR)/oci
NODE_IMAGE_TAG := $(shell cat VERSION)
# Every time in the layers is clamped to this one: $(SOURCE_DATE_EPOCH), else the time of the
# commit that last changed VERSION, so that builds of one version write the same bytes.
NODE_IMAGE_EPOCH ?= $(or $(SOURCE_DATE_EPOCH),$(shell git log -1 --format=%ct -- VERSION 2>/dev/null),0)

# Where the image keeps what is not Debian's.
NODE_OPT := /opt/deltagym
NODE_SHARE := /usr/share/deltagym
# The entrypoint: a node serving on every address, its data below /var/lib/deltagym (a volume
# of the node's disk, in a cluster), with the programs and the default env the image holds.
# Arguments given to the container (a chart's args) follow it and override its flags.
NODE_ENTRYPOINT := /usr/local/bin/deltagym serve --addr 0.0.0.0:8080 --data /var/lib/deltagym \
	--envs $(NODE_SHARE)/envs --default-image $(NODE_SHARE)/images/default/rootfs \
	--init /usr/local/bin/dg-init --criu $(NODE_OPT)/criu/bin/criu --postgres-bin $(NODE_OPT)/postgres/bin

node-image: deps $(NODE_IMAGE_OCI)/index.json ## build the node's container image, an OCI layout in .data/images/node/oci tagged VERSION (cached; docs/NODE-IMAGE.md)

$(NODE_ROOTFS)/.deltagym-image-stamp:
	@./scripts/build-default-image.sh $(NODE_ROOTFS) node

# criu and postgres are phony: their scripts, cached, run every time, and so does this one, which
# rewrites the stamp only when the prefixes' stamps say something new.
$(NODE_PROGRAMS)/.stamp: criu postgres scripts/node-programs.sh
	@./scripts/node-programs.sh $(NODE_PROGRAMS) $(CRIU_PREFIX) $(PG_PREFIX)

# The server as the image runs it: static (no cgo: nothing of the Debian root's libc is
# needed), without the build's paths, so that one source and toolchain give one binary.
NODE_GO_SOURCES := $(shell find cmd server envpool sandbox clients/go internal -type f \( -name '*.go' -o -name '*.sql' \) -not -name '*_test.go' 2>/dev/null)

$(NODE_IMAGE_DIR)/bin/deltagym: $(NODE_GO_SOURCES) go.mod go.sum clients/go/go.mod
	@mkdir -p $(@D)
	CGO_ENABLED=0 go build -trimpath -ldflags='-s -w' -o $@ ./cmd/deltagym

$(BIN)/ocilayout: $(filter-out %_test.go,$(wildcard scripts/ocilayout/*.go)) go.mod | $(BIN)
	go build -o $@ ./scripts/ocilayout

# The base layer: the Debian root, the programs and the default sandbox image, which change
# with Debian's packages, not with the server.
$(NODE_LAYERS)/base.json: $(NODE_ROOTFS)/.deltagym-image-stamp $(NODE_PROGRAMS)/.stamp \
		$(IMAGE_ROOTFS)/.deltagym-image-stamp $(IMAGE_ROOTFS)/.deltagym-identity-stamp VERSION $(BIN)/ocilayout
	@mkdir -p $(@D)
	$(BIN)/ocilayout layer -layout $(NODE_IMAGE_OCI) -o $@ -epoch $(NODE_IMAGE_EPOCH) -exclude /.deltagym-image-stamp \
		/=$(NODE_ROOTFS) $(NODE_OPT)=$(NODE_PROGRAMS) $(NODE_SHARE)/images/default/rootfs=$(IMAGE_ROOTFS)

# The top layer: what a change of the server changes, owned by root whoever checked it out.
$(NODE_LAYERS)/top.json: $(NODE_IMAGE_DIR)/bin/deltagym $(BIN)/dg-init envs $(wildcard envs/*) VERSION $(BIN)/ocilayout
	@mkdir -p $(@D)
	$(BIN)/ocilayout layer -layout $(NODE_IMAGE_OCI) -o $@ -epoch $(NODE_IMAGE_EPOCH) -chown 0:0 \
		/usr/local/bin/deltagym=$(NODE_IMAGE_DIR)/bin/deltagym /usr/local/bin/dg-init=$(BIN)/dg-init $(NODE_SHARE)/envs=$(CURDIR)/envs

$(NODE_IMAGE_OCI)/index.json: $(NODE_LAYERS)/base.json $(NODE_LAYERS)/top.json VERSION mk/nodeimage.mk $(BIN)/ocilayout
	$(BIN)/ocilayout image -layout $(NODE_IMAGE_OCI) -tag $(NODE_IMAGE_TAG) -epoch $(NODE_IMAGE_EPOCH) \
		-layer $(NODE_LAYERS)/base.json -layer $(NODE_LAYERS)/top.json \
		$(foreach a,$(NODE_ENTRYPOINT),-entrypoint $(a)) \
		-env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin -workdir / -port 8080/tcp \
		-label org.opencontainers.image.title=deltagym-node -label org.opencontainers.image.version=$(NODE_IMAGE_TAG) \
		-label 'org.opencontainers.image.description=A deltagym node: the server, CRIU, PostgreSQL 17 and the default sandbox image'
