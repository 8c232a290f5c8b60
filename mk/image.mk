# Images: the default sandbox image rootfs that `make run` uses (built once, then cached).
DEPS_GROUPS += image

.PHONY: image

image: $(DATA)/images/default/rootfs/.deltagym-image-stamp ## build the default image rootfs (Debian bookworm minbase + python3, git, procps; cached)

$(DATA)/images/default/rootfs/.deltagym-image-stamp:
	@./scripts/build-default-image.sh $(DATA)/images/default/rootfs
