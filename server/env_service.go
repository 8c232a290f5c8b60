package server

import (
	"context"
	"fmt"

	"connectrpc.com/connect"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/clients/go/gen/deltagym/v1/deltagymv1connect"
	"github.com/deltagym/deltagym/envpool"
)

// envService serves EnvService. The catalog and image calls are here; the episode calls
// (episode_service.go) decode their request, call the episode core and map its result and
// errors.
type envService struct{ s *Server }

var _ deltagymv1connect.EnvServiceHandler = (*envService)(nil)

func (e *envService) envInfo(env *envpool.Env) *deltagymv1.EnvInfo {
	info := &deltagymv1.EnvInfo{Spec: env.Spec(), WarmCount: int32(env.Warm()), ActiveCount: int32(e.s.pools.Active(env.Name()))}
	if err := env.Err(); err != nil {
		info.NotReady = e.s.message(err)
	}
	if err := env.Waiting(); err != nil {
		info.WaitingForCapacity = e.s.message(err)
	}
	return info
}

func (e *envService) ListEnvs(ctx context.Context, req *connect.Request[deltagymv1.ListEnvsRequest]) (*connect.Response[deltagymv1.ListEnvsResponse], error) {
	resp := &deltagymv1.ListEnvsResponse{}
	for _, env := range e.s.pools.Envs() {
		resp.Envs = append(resp.Envs, e.envInfo(env))
	}
	return connect.NewResponse(resp), nil
}

func (e *envService) RegisterEnv(ctx context.Context, req *connect.Request[deltagymv1.RegisterEnvRequest]) (*connect.Response[deltagymv1.RegisterEnvResponse], error) {
	env, err := e.s.registerEnv(req.Msg.GetSpec(), req.Msg.GetReplace())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	e.s.log.Info("env registered", "env", env.Name(), "replace", req.Msg.GetReplace())
	return connect.NewResponse(&deltagymv1.RegisterEnvResponse{Env: e.envInfo(env)}), nil
}

func (e *envService) ImportImage(ctx context.Context, req *connect.Request[deltagymv1.ImportImageRequest]) (*connect.Response[deltagymv1.ImportImageResponse], error) {
	m := req.Msg
	if m.GetName() == "" || m.GetPath() == "" {
		return nil, e.s.toConnect(fmt.Errorf("import needs a name and a path: %w", ErrInvalid))
	}
	if m.GetReference() != "" {
		return nil, e.s.toConnect(fmt.Errorf("picking an image by reference is not supported yet; import a layout or archive holding one image: %w", ErrInvalid))
	}
	if _, ok := deltagymv1.ImageFormat_name[int32(m.GetFormat())]; !ok {
		return nil, e.s.toConnect(fmt.Errorf("unknown image format %d (leave it unset to have it found from the path): %w", m.GetFormat(), ErrInvalid))
	}
	src, err := e.s.imports.open(m.GetPath())
	if err != nil {
		return nil, e.s.toConnect(err)
	}
	defer src.Close()
	st, err := src.Stat()
	if err != nil {
		return nil, e.s.toConnect(fmt.Errorf("reading image path %q: %w", m.GetPath(), err))
	}
	switch m.GetFormat() {
	case deltagymv1.ImageFormat_IMAGE_FORMAT_DOCKER_ARCHIVE:
		if !st.Mode().IsRegular() {
			return nil, e.s.toConnect(fmt.Errorf("%q is not a docker save tarball (a regular file): %w", m.GetPath(), ErrInvalid))
		}
	case deltagymv1.ImageFormat_IMAGE_FORMAT_OCI_LAYOUT, deltagymv1.ImageFormat_IMAGE_FORMAT_ROOTFS_DIR:
		if !st.IsDir() {
			return nil, e.s.toConnect(fmt.Errorf("%q is not a directory: %w", m.GetPath(), ErrInvalid))
		}
	}
	if !st.IsDir() && !st.Mode().IsRegular() {
		return nil, e.s.toConnect(fmt.Errorf("%q is neither a directory nor a regular file: %w", m.GetPath(), ErrInvalid))
	}
	ctx, done := e.s.obs.op(ctx, "import_image")
	info, err := e.s.rt.ImportImage(ctx, m.GetName(), fdPath(src), e.s.imports.options()...)
	done(err)
	if err != nil {
		return nil, e.s.toConnect(renamedError{err: err, old: fdPath(src), new: m.GetPath()})
	}
	e.s.pools.ImageImported(info.Name)
	return connect.NewResponse(&deltagymv1.ImportImageResponse{Name: info.Name, Digest: info.Digest, LayerCount: int32(info.Layers)}), nil
}
