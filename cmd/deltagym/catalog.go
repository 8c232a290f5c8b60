package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	deltagym "github.com/deltagym/deltagym/clients/go/deltagym"
	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
)

// registerEnvCmd registers the env described by a spec file in the catalog's format (the
// server's envs/*.json), which the server keeps across restarts.
type registerEnvCmd struct {
	Spec    string `arg:"" placeholder:"SPEC.json|-" help:"the env's spec file (- for standard input)"`
	Replace bool   `help:"replace an env of the same name (its running sandboxes keep the old spec)"`
}

func (r *registerEnvCmd) Run(ctx context.Context, a *app) error {
	body, err := readInput(a.stdin, r.Spec)
	if err != nil {
		return err
	}
	spec := &deltagymv1.EnvSpec{}
	if err := protojson.Unmarshal(body, spec); err != nil {
		from := r.Spec
		if from == "-" {
			from = "standard input"
		}
		return fmt.Errorf("%s: not an env spec (the JSON of envs/*.json; fields in proto/deltagym/v1/env.proto): %v", from, err)
	}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	// Each node keeps its own catalog: in a cluster the env goes to every node, so that a
	// Reset placed on any of them finds it.
	var registered []*deltagymv1.EnvInfo
	err = c.each(func(_ string, cl *deltagym.Client) error {
		res, err := cl.EnvService().RegisterEnv(ctx, connect.NewRequest(&deltagymv1.RegisterEnvRequest{Spec: spec, Replace: r.Replace}))
		if err != nil {
			return err
		}
		if a.JSON {
			if err := printJSON(a.stdout, res.Msg); err != nil {
				return err
			}
		}
		registered = append(registered, res.Msg.GetEnv())
		return nil
	})
	if !a.JSON && len(registered) > 0 {
		err = errors.Join(printEnvs(a.stdout, &deltagymv1.ListEnvsResponse{Envs: registered[:1]}), err)
	}
	return err
}

// imageFormats are the values of import-image --format ("": found out from the path).
var imageFormats = map[string]deltagymv1.ImageFormat{
	"":       deltagymv1.ImageFormat_IMAGE_FORMAT_UNSPECIFIED,
	"oci":    deltagymv1.ImageFormat_IMAGE_FORMAT_OCI_LAYOUT,
	"docker": deltagymv1.ImageFormat_IMAGE_FORMAT_DOCKER_ARCHIVE,
	"rootfs": deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR,
}

// importImageCmd imports an image from a path on the server's machine (a relative one is
// taken from the server's import root).
type importImageCmd struct {
	Name   string `arg:"" help:"the image's name, for envs to give as their image"`
	Path   string `arg:"" help:"the image on the server's machine, below its import root"`
	Format string `predictor:"format" placeholder:"oci|docker|rootfs" help:"oci (an OCI layout directory), docker (a docker save tarball) or rootfs (a directory); default: found out from the path"`
}

func (ic *importImageCmd) Run(ctx context.Context, a *app) error {
	format, ok := imageFormats[ic.Format]
	if !ok {
		return usageErrorf("--format %q: want oci, docker or rootfs", ic.Format)
	}
	req := &deltagymv1.ImportImageRequest{Name: ic.Name, Path: ic.Path, Format: format}
	c, err := a.dial(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	// Each node keeps its own images, read from its own import root: in a cluster every node
	// imports the path from its own machine.
	return c.each(func(node string, cl *deltagym.Client) error {
		res, err := cl.EnvService().ImportImage(ctx, connect.NewRequest(req))
		if err != nil {
			return err
		}
		if a.JSON {
			return printJSON(a.stdout, res.Msg)
		}
		return fields(a.stdout, "node", node, "image", res.Msg.GetName(), "digest", res.Msg.GetDigest(),
			"layers", strconv.Itoa(int(res.Msg.GetLayerCount())))
	})
}
