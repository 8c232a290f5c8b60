// Command ocilayout writes a container image as an OCI image layout (oci-layout, index.json,
// blobs/sha256) from directory trees, without a container engine: `make node-image` builds the
// image of a deltagym node with it (docs/NODE-IMAGE.md).
//
//	ocilayout layer -layout DIR -o DESC.json [-epoch N] [-chown UID:GID] [-exclude PATH]... DEST=SRC...
//	ocilayout image -layout DIR -tag TAG [-epoch N] -layer DESC.json... [-entrypoint ARG]... [-cmd ARG]...
//	                [-env K=V]... [-port PORT/PROTO]... [-workdir DIR] [-label K=V]...
//	ocilayout check DIR
//
// layer writes one layer: a tar of the trees DEST=SRC merged into one (SRC's contents at the
// image path DEST; a later DEST below an earlier one replaces what the earlier tree has there;
// a file SRC is a single file), gzip-compressed into DIR/blobs/sha256, and a descriptor of it
// (digest, size, diff_id) into DESC.json for image. image writes the config, the manifest and
// index.json (the manifest named TAG by org.opencontainers.image.ref.name) over the layers
// given, bottom first, and deletes the blobs they no longer reference. check verifies a layout:
// every descriptor's digest, size and media type, and every layer's diff_id.
//
// Layers are reproducible: the same trees give the same bytes. Entries are sorted by name,
// owners are numeric (no user or group names), times are the file's modification time clamped
// to the epoch (-epoch, default $SOURCE_DATE_EPOCH, else 0) with access and change times left
// out, hard links are kept, and so are xattrs (security.capability, say) but overlayfs's own and
// SELinux labels, which belong to the build host.
package main

import (
	"fmt"
	"io"
	"os"
)

func main() {
	if err := run(os.Args[1:], os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "ocilayout:", err)
		os.Exit(1)
	}
}

const usage = "usage: ocilayout layer|image|check ... (see the package doc, go doc ./scripts/ocilayout)"

// run runs one subcommand, which says what it did to log.
func run(args []string, log io.Writer) error {
	if len(args) == 0 {
		return fmt.Errorf("%s", usage)
	}
	switch args[0] {
	case "layer":
		return runLayer(args[1:], log)
	case "image":
		return runImage(args[1:], log)
	case "check":
		return runCheck(args[1:], log)
	default:
		return fmt.Errorf("unknown subcommand %q; %s", args[0], usage)
	}
}
