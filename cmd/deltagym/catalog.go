package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// runRegisterEnv registers the env described by a spec file in the catalog's format (the
// server's envs/*.json), which the server keeps across restarts.
func runRegisterEnv(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	replace := fs.Bool("replace", false, "replace an env of the same name (its running sandboxes keep the old spec)")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 1, 1, "SPEC.json|-"); err != nil {
		return err
	}
	body, err := readInput(a.stdin, pos[0])
	if err != nil {
		return err
	}
	spec := &deltagymv1.EnvSpec{}
	if err := protojson.Unmarshal(body, spec); err != nil {
		from := pos[0]
		if from == "-" {
			from = "standard input"
		}
		return fmt.Errorf("%s: not an env spec (the JSON of envs/*.json; fields in proto/deltagym/v1/env.proto): %v", from, err)
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().RegisterEnv(ctx, connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: spec, Replace: *replace}))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	return printEnvs(a.stdout, &deltagymv1.ListEnvsResponse{Envs: []*deltagymv1.EnvInfo{res.Msg.GetEnv()}})
}

// runImportImage imports an image from a path on the server's machine (a relative one is
// taken from the working directory, for a server on this machine).
func runImportImage(ctx context.Context, a *app, fs *flag.FlagSet, args []string) error {
	format := fs.String("format", "", "oci (an OCI layout directory), docker (a docker save tarball) or rootfs (a directory); default: found out from the path")
	pos, _, err := parseArgs(fs, args)
	if err != nil {
		return err
	}
	if err := wantArgs(pos, 2, 2, "NAME and PATH"); err != nil {
		return err
	}
	req := &deltagymv1.ImportImageRequest{Name: pos[0], Path: pos[1]}
	switch *format {
	case "":
	case "oci":
		req.Format = deltagymv1.ImageFormat_IMAGE_FORMAT_OCI_LAYOUT
	case "docker":
		req.Format = deltagymv1.ImageFormat_IMAGE_FORMAT_DOCKER_ARCHIVE
	case "rootfs":
		req.Format = deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR
	default:
		return usageErrorf("--format %q: want oci, docker or rootfs", *format)
	}
	c, err := a.dial()
	if err != nil {
		return err
	}
	defer c.Close()
	res, err := c.EnvService().ImportImage(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	if a.json {
		return printJSON(a.stdout, res.Msg)
	}
	return fields(a.stdout, "image", res.Msg.GetName(), "digest", res.Msg.GetDigest(),
		"layers", strconv.Itoa(int(res.Msg.GetLayerCount())))
}
