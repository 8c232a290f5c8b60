# Images: the default sandbox image rootfs that `make run` uses (built once, then cached).
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
