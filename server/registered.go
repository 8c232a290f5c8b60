package server

import (
	"fmt"
	"os"
	"path/filepath"

	"google.golang.org/protobuf/encoding/protojson"

	"github.com/deltagym/deltagym/envpool"
	deltagymv1 "github.com/deltagym/deltagym/proto/gen/go/deltagym/v1"
)

// Envs registered over the API (RegisterEnv) are kept in DataDir/envs, one <name>.json each in
// the catalog's format, and loaded at start after the catalog (Config.EnvsDir), over any of
// its envs of the same name: a server started again serves the envs it served before.

// registeredDir is where the server keeps the envs registered over the API.
func (s *Server) registeredDir() string { return filepath.Join(s.cfg.DataDir, "envs") }

// withRegistered returns the catalog's specs with the registered ones added, a registered
// spec replacing the catalog's of its name.
func (s *Server) withRegistered(catalog []*deltagymv1.EnvSpec) ([]*deltagymv1.EnvSpec, error) {
	reg, err := envpool.LoadDir(s.registeredDir())
	if err != nil {
		return nil, fmt.Errorf("loading the envs registered over the API (fix or remove the file): %w", err)
	}
	byName := map[string]int{}
	for i, sp := range catalog {
		byName[sp.GetName()] = i
	}
	out := catalog
	for _, sp := range reg {
		if i, ok := byName[sp.GetName()]; ok {
			s.log.Info("env registered over the API replaces the catalog's", "env", sp.GetName(),
				"file", filepath.Join(s.registeredDir(), sp.GetName()+".json"))
			out[i] = sp
			continue
		}
		out = append(out, sp)
	}
	return out, nil
}

// registerEnv registers spec with the pools and keeps it for the next start. The spec is
// written to a temporary file first and renamed into place once the pools took it, so a
// refused spec leaves nothing behind and a kept one is whole.
func (s *Server) registerEnv(spec *deltagymv1.EnvSpec, replace bool) (*envpool.Env, error) {
	if err := envpool.ValidateSpec(spec); err != nil {
		return nil, err
	}
	s.regMu.Lock()
	defer s.regMu.Unlock()
	dir := s.registeredDir()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("keeping registered env %s: %w", spec.GetName(), err)
	}
	body, err := protojson.MarshalOptions{Multiline: true}.Marshal(spec)
	if err != nil {
		return nil, err
	}
	tmp, err := os.CreateTemp(dir, ".register-*")
	if err != nil {
		return nil, fmt.Errorf("keeping registered env %s: %w", spec.GetName(), err)
	}
	defer os.Remove(tmp.Name()) // once renamed, a no-op
	_, err = tmp.Write(append(body, '\n'))
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, fmt.Errorf("keeping registered env %s: %w", spec.GetName(), err)
	}
	env, err := s.pools.Register(spec, replace)
	if err != nil {
		return nil, err
	}
	if err := os.Rename(tmp.Name(), filepath.Join(dir, spec.GetName()+".json")); err != nil {
		return env, fmt.Errorf("env %s is registered until the server stops, not kept for its next start: %w", spec.GetName(), err)
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return env, nil
}
