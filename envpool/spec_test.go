package envpool_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/deltagym/deltagym/envpool"
	"github.com/deltagym/deltagym/internal/errdefs"
)

func TestShippedSpecsLoad(t *testing.T) {
	specs, err := envpool.LoadDir("../envs")
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, s := range specs {
		if s.GetName() == "shell" && s.GetImage() == "default" {
			found = true
		}
	}
	if !found {
		t.Fatal("envs/ has no shell env on the default image")
	}
}

func TestBadSpecsNameFileAndField(t *testing.T) {
	cases := []struct {
		name, body, field string
	}{
		{"bad name", `{"name": "Bad Name", "image": "x"}`, "field name"},
		{"no image", `{"name": "a"}`, "field image"},
		{"negative pool", `{"name": "a", "image": "x", "pool_size": -1}`, "field pool_size"},
		{"huge pool", `{"name": "a", "image": "x", "poolSize": 100000}`, "field pool_size"},
		{"negative memory", `{"name": "a", "image": "x", "limits": {"memory_bytes": -5}}`, "field limits.memory_bytes"},
		{"negative budget", `{"name": "a", "image": "x", "budgets": {"max_steps": -1}}`, "field budgets.max_steps"},
		{"relative workdir", `{"name": "a", "image": "x", "workdir": "tmp"}`, "field workdir"},
		{"empty setup", `{"name": "a", "image": "x", "setup": ["ok", " "]}`, "field setup[1]"},
		{"unknown field", `{"name": "a", "image": "x", "colour": "red"}`, "colour"},
		{"not json", `{"name": `, "decoding"},
		{"egress without port", `{"name": "a", "image": "x", "egress": {"allow": ["pypi.org:443", "pypi.org"]}}`, "field egress.allow[1]"},
		{"egress bad port", `{"name": "a", "image": "x", "egress": {"allow": ["pypi.org:0"]}}`, "field egress.allow[0]"},
		{"egress bad host", `{"name": "a", "image": "x", "egress": {"allow": ["*.org:443"]}}`, "field egress.allow[0]"},
		{"egress limits alone", `{"name": "a", "image": "x", "egress": {"limits": {"max_connections": 2}}}`, "field egress.limits: limits without an allow-list"},
		{"egress negative limit", `{"name": "a", "image": "x", "egress": {"allow": ["pypi.org:443"], "limits": {"max_bytes_down": -1}}}`, "field egress.limits.max_bytes_down"},
		{"egress idle past a day", `{"name": "a", "image": "x", "egress": {"allow": ["pypi.org:443"], "limits": {"idle_timeout_seconds": 86401}}}`, "field egress.limits.idle_timeout_seconds"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			file := filepath.Join(dir, "bad.json")
			if err := os.WriteFile(file, []byte(tc.body), 0o644); err != nil {
				t.Fatal(err)
			}
			_, err := envpool.LoadDir(dir)
			if !errors.Is(err, envpool.ErrInvalidSpec) || !strings.Contains(err.Error(), file) || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("error %v does not name %s and %q", err, file, tc.field)
			}
		})
	}
	t.Run("duplicate name", func(t *testing.T) {
		dir := t.TempDir()
		for _, f := range []string{"a.json", "b.json"} {
			if err := os.WriteFile(filepath.Join(dir, f), []byte(`{"name": "same", "image": "x"}`), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := envpool.LoadDir(dir); !errors.Is(err, envpool.ErrInvalidSpec) || !strings.Contains(err.Error(), "a.json") {
			t.Fatalf("duplicate: %v", err)
		}
	})
}

// The evaluation's fields are checked before the env is registered: every bad one names its
// field and is an invalid spec (invalid_argument at the API).
func TestEvaluationSpec(t *testing.T) {
	const v = `"verifier": "true", `
	bad := []struct {
		name, body, field string
	}{
		{"unknown mode", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": 7}}`, "field evaluation.mode"},
		{"pristine without a verifier", `{"name": "a", "image": "x", "evaluation": {"mode": "VERIFIER_MODE_PRISTINE"}}`, "field evaluation.mode"},
		{"copy paths in the agent's sandbox", `{"name": "a", "image": "x", ` + v + `"evaluation": {"copy_paths": ["/work"]}}`, "field evaluation:"},
		{"secret option in the agent's sandbox", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_SANDBOX", "secret_options": ["X"]}}`, "field evaluation:"},
		{"verifier files in the agent's sandbox", `{"name": "a", "image": "x", ` + v + `"evaluation": {"verifier_files": "v"}}`, "field evaluation:"},
		{"relative copy path", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "copy_paths": ["work/a"]}}`, "field evaluation.copy_paths[0]"},
		{"root copy path", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "copy_paths": ["/"]}}`, "field evaluation.copy_paths[0]"},
		{"unclean copy path", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "copy_paths": ["/work/../etc"]}}`, "field evaluation.copy_paths[0]"},
		{"nested copy paths", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "copy_paths": ["/work", "/work/a"]}}`, "field evaluation.copy_paths[1]"},
		{"copy path over the verifier files", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "verifier_files": "v", "copy_paths": ["/verifier/x"]}}`, "field evaluation.copy_paths[0]"},
		{"unclean verifier files", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "verifier_files": "v/../../w"}}`, "field evaluation.verifier_files"},
		{"relative verifier files path", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "verifier_files_path": "verifier"}}`, "field evaluation.verifier_files_path"},
		{"bad env name", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "env": {"A=B": "c"}}}`, "field evaluation.env"},
		{"bad secret option", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "secret_options": ["DELTAGYM_SEED"]}}`, "field evaluation.secret_options[0]"},
		{"negative cap", `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "max_copy_bytes": -1}}`, "field evaluation:"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			_, err := envpool.ParseSpec([]byte(tc.body))
			if !errors.Is(err, envpool.ErrInvalidSpec) || !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.field) {
				t.Fatalf("error %v is not an invalid spec naming %q", err, tc.field)
			}
		})
	}
	good := `{"name": "a", "image": "x", ` + v + `"evaluation": {"mode": "VERIFIER_MODE_PRISTINE", "copy_paths": ["/work/a", "/work/ab"],
		"verifier_files": "envs/a", "verifier_files_path": "/opt/v", "env": {"PATH": "/bin"}, "secret_options": ["EXPECTED"],
		"max_copy_bytes": 4096, "max_copy_entries": 3}}`
	spec, err := envpool.ParseSpec([]byte(good))
	if err != nil {
		t.Fatalf("a good pristine spec: %v", err)
	}
	if e := spec.GetEvaluation(); len(e.GetCopyPaths()) != 2 || e.GetSecretOptions()[0] != "EXPECTED" || e.GetMaxCopyEntries() != 3 {
		t.Fatalf("decoded evaluation: %v", e)
	}
}

func TestParseReward(t *testing.T) {
	cases := []struct {
		out    string
		reward float64
		comp   map[string]float64
		bad    bool
	}{
		{"0.5\n", 0.5, nil, false},
		{"log line\n1\n\n", 1, nil, false},
		{`{"reward": 2, "components": {"a": 1}}`, 2, map[string]float64{"a": 1}, false},
		{"", 0, nil, true},
		{"not a number", 0, nil, true},
		{`{"components": {}}`, 0, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.out, func(t *testing.T) {
			r, comp, err := envpool.ParseReward([]byte(tc.out))
			if tc.bad {
				if !errors.Is(err, envpool.ErrVerifier) {
					t.Fatalf("err %v, want ErrVerifier", err)
				}
				return
			}
			if err != nil || r != tc.reward || len(comp) != len(tc.comp) || comp["a"] != tc.comp["a"] {
				t.Fatalf("got %v %v %v", r, comp, err)
			}
		})
	}
}

func FuzzParseSpec(f *testing.F) {
	f.Add([]byte(`{"name": "a", "image": "x", "setup": ["true"], "pool_size": 3}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		spec, err := envpool.ParseSpec(data)
		if err == nil && envpool.ValidateSpec(spec) != nil {
			t.Fatal("parsed spec fails validation")
		}
	})
}

func TestEgressSpecParses(t *testing.T) {
	spec, err := envpool.ParseSpec([]byte(`{"name": "a", "image": "x", "egress": {"allow": ["pypi.org:443", "127.0.0.1:8000", "[::1]:80"]}}`))
	if err != nil {
		t.Fatal(err)
	}
	if got := spec.GetEgress().GetAllow(); len(got) != 3 {
		t.Fatalf("egress.allow = %v", got)
	}
}
