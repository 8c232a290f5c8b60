package server

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/envpool"
)

// Envs registered over the API (RegisterEnv) are kept in DataDir/envs, one <name>.json each in
// the catalog's format, and loaded at start after the catalog (Config.EnvsDir), over any of
// its envs of the same name: a server started again serves the envs it served before. To
// drop one, delete its file while the server is stopped.

// registeredDir is where the server keeps the envs registered over the API.
func (s *Server) registeredDir() string { return filepath.Join(s.cfg.DataDir, "envs") }

// withRegistered returns the catalog's specs with the kept ones added, a kept spec replacing
// the catalog's of its name. A kept file that no longer reads as a valid spec (a later
// server's stricter checks) is set aside as <file>.bad with an error in the log, so that the
// server still starts; a temporary file a crash left is removed. Unknown fields are ignored
// (a newer server's, after a downgrade).
func (s *Server) withRegistered(catalog []*deltagymv1.EnvSpec) ([]*deltagymv1.EnvSpec, error) {
	dir := s.registeredDir()
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return catalog, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the envs registered over the API: %w", err)
	}
	byName := map[string]int{}
	for i, sp := range catalog {
		byName[sp.GetName()] = i
	}
	out := catalog
	names := []string{}
	for _, e := range ents {
		names = append(names, e.Name())
	}
	sort.Strings(names)
	for _, name := range names {
		path := filepath.Join(dir, name)
		if strings.HasPrefix(name, ".register-") {
			_ = os.Remove(path)
			continue
		}
		if !strings.HasSuffix(name, ".json") {
			continue
		}
		sp, err := readKeptSpec(path)
		if err != nil {
			s.log.Error("env registered over the API set aside: it no longer reads as an env spec", "file", path+".bad", "err", err)
			if err := os.Rename(path, path+".bad"); err != nil {
				return nil, fmt.Errorf("setting aside %s: %w", path, err)
			}
			continue
		}
		if i, ok := byName[sp.GetName()]; ok {
			s.log.Warn("env registered over the API replaces the catalog's (delete its file, the server stopped, to serve the catalog's again)",
				"env", sp.GetName(), "file", path)
			out[i] = sp
			continue
		}
		byName[sp.GetName()] = len(out)
		out = append(out, sp)
	}
	return out, nil
}

// readKeptSpec reads one kept spec, whose file must be named after it.
func readKeptSpec(path string) (*deltagymv1.EnvSpec, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	sp := &deltagymv1.EnvSpec{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(b, sp); err != nil {
		return nil, err
	}
	if err := envpool.ValidateSpec(sp); err != nil {
		return nil, err
	}
	if want := strings.TrimSuffix(filepath.Base(path), ".json"); sp.GetName() != want {
		return nil, fmt.Errorf("the spec is named %q, the file %q", sp.GetName(), want)
	}
	return sp, nil
}

// registerEnv keeps spec for the next start and registers it with the pools. The file is
// written first (a temporary file, fsynced, renamed into place, the directory fsynced), and
// put back as it was if the pools refuse the spec, so a refused spec changes nothing and a
// registered one is kept whole.
func (s *Server) registerEnv(spec *deltagymv1.EnvSpec, replace bool) (*envpool.Env, error) {
	if err := envpool.ValidateSpec(spec); err != nil {
		return nil, err
	}
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if _, err := s.pools.Env(spec.GetName()); err == nil && !replace {
		return nil, fmt.Errorf("env %s: %w", spec.GetName(), envpool.ErrEnvExists)
	}
	path := filepath.Join(s.registeredDir(), spec.GetName()+".json")
	old, err := os.ReadFile(path)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("keeping registered env %s: %w", spec.GetName(), err)
	}
	body, err := protojson.MarshalOptions{Multiline: true, UseProtoNames: true}.Marshal(spec)
	if err != nil {
		return nil, err
	}
	if err := s.keepFile(path, append(body, '\n')); err != nil {
		return nil, fmt.Errorf("keeping registered env %s: %w", spec.GetName(), err)
	}
	env, err := s.pools.Register(spec, replace)
	if err != nil {
		var rerr error
		if old != nil {
			rerr = s.keepFile(path, old)
		} else {
			rerr = os.Remove(path)
		}
		if rerr != nil {
			s.log.Error("putting back the kept env after a refused registration", "file", path, "err", rerr)
		}
		return nil, err
	}
	return env, nil
}

// keepFile replaces path with body durably: a temporary file in its directory, fsynced, renamed
// over it, and the directory (and, when it had to be made, its parent) fsynced.
func (s *Server) keepFile(path string, body []byte) error {
	dir := filepath.Dir(path)
	if _, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
		if err := syncDir(filepath.Dir(dir)); err != nil {
			return err
		}
	}
	tmp, err := os.CreateTemp(dir, ".register-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // once renamed, a no-op
	_, err = tmp.Write(body)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	return syncDir(dir)
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
