package envpool

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	deltagymv1 "github.com/deltagym/deltagym/clients/go/gen/deltagym/v1"
	"github.com/deltagym/deltagym/sandbox/egress"
)

// MaxPoolSize bounds an env's pool_size.
const MaxPoolSize = 256

var envNameRE = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,62}$`)

// LoadDir reads every *.json file of dir as one EnvSpec (protobuf JSON: field names in
// snake_case or lowerCamelCase, unknown fields refused) and validates it. The specs are returned
// sorted by name. Any bad file fails the whole load with an error naming the file and field.
func LoadDir(dir string) ([]*deltagymv1.EnvSpec, error) {
	names, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, fmt.Errorf("listing env specs in %s: %w", dir, err)
	}
	sort.Strings(names)
	seen := map[string]string{}
	var specs []*deltagymv1.EnvSpec
	for _, name := range names {
		data, err := os.ReadFile(name)
		if err != nil {
			return nil, fmt.Errorf("reading env spec: %w", err)
		}
		spec, err := ParseSpec(data)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if prev, ok := seen[spec.GetName()]; ok {
			return nil, fmt.Errorf("%s: field name: %q is also defined in %s: %w", name, spec.GetName(), prev, ErrInvalidSpec)
		}
		seen[spec.GetName()] = name
		specs = append(specs, spec)
	}
	sort.Slice(specs, func(i, j int) bool { return specs[i].GetName() < specs[j].GetName() })
	return specs, nil
}

// ParseSpec decodes one EnvSpec from its protobuf JSON form and validates it.
func ParseSpec(data []byte) (*deltagymv1.EnvSpec, error) {
	spec := &deltagymv1.EnvSpec{}
	if err := protojson.Unmarshal(data, spec); err != nil {
		return nil, fmt.Errorf("decoding: %v: %w", err, ErrInvalidSpec)
	}
	if err := ValidateSpec(spec); err != nil {
		return nil, err
	}
	return spec, nil
}

// ValidateSpec checks a spec's fields; the error names the first bad field.
func ValidateSpec(s *deltagymv1.EnvSpec) error {
	if s == nil {
		return badField("spec", "missing")
	}
	if !envNameRE.MatchString(s.GetName()) {
		return badField("name", "%q is not 1-63 of lower-case letters, digits, '-', '_', '.' starting with a letter or digit", s.GetName())
	}
	if s.GetImage() == "" {
		return badField("image", "required")
	}
	for _, check := range []func(*deltagymv1.EnvSpec) error{validateCommands, validateLimits, validateBudgets, validateEvaluation, validateEgress} {
		if err := check(s); err != nil {
			return err
		}
	}
	if p := s.GetPoolSize(); p < 0 || p > MaxPoolSize {
		return badField("pool_size", "%d is not between 0 and %d", p, MaxPoolSize)
	}
	if _, ok := deltagymv1.ProcessMode_name[int32(s.GetProcessMode())]; !ok {
		return badField("process_mode", "unknown value %d", s.GetProcessMode())
	}
	return nil
}

// badField is the error of a spec's bad field.
func badField(field, format string, args ...any) error {
	return fmt.Errorf("field %s: %s: %w", field, fmt.Sprintf(format, args...), ErrInvalidSpec)
}

// validateCommands checks the setup commands, the environment and the workdir.
func validateCommands(s *deltagymv1.EnvSpec) error {
	for i, c := range s.GetSetup() {
		if strings.TrimSpace(c) == "" {
			return badField(fmt.Sprintf("setup[%d]", i), "empty command")
		}
	}
	for k := range s.GetEnv() {
		if k == "" || strings.ContainsAny(k, "=\x00") {
			return badField("env", "variable name %q is empty or holds '=' or NUL", k)
		}
	}
	if w := s.GetWorkdir(); w != "" && !strings.HasPrefix(w, "/") {
		return badField("workdir", "%q is not absolute", w)
	}
	return nil
}

// validateLimits checks that every limit is a finite, non-negative number.
func validateLimits(s *deltagymv1.EnvSpec) error {
	l := s.GetLimits()
	if l == nil {
		return nil
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"limits.memory_bytes", float64(l.GetMemoryBytes())}, {"limits.pids", float64(l.GetPids())},
		{"limits.cpus", l.GetCpus()}, {"limits.disk_bytes", float64(l.GetDiskBytes())},
		{"limits.output_bytes", float64(l.GetOutputBytes())}, {"limits.step_timeout_seconds", l.GetStepTimeoutSeconds()},
	} {
		if !finiteNonNegative(f.v) {
			return badField(f.name, "%v is negative or not a number", f.v)
		}
	}
	return nil
}

// validateBudgets checks the episode budgets.
func validateBudgets(s *deltagymv1.EnvSpec) error {
	b := s.GetBudgets()
	if b == nil {
		return nil
	}
	if b.GetMaxSteps() < 0 {
		return badField("budgets.max_steps", "%d is negative", b.GetMaxSteps())
	}
	if v := b.GetMaxSeconds(); !finiteNonNegative(v) {
		return badField("budgets.max_seconds", "%v is negative or not a number", v)
	}
	return nil
}

// validateEvaluation checks where and how the verifier runs. A verifier_files directory is
// checked when the env is registered (Manager.Register), where the import root is known.
func validateEvaluation(s *deltagymv1.EnvSpec) error {
	e := s.GetEvaluation()
	if e == nil {
		return nil
	}
	if _, ok := deltagymv1.VerifierMode_name[int32(e.GetMode())]; !ok {
		return badField("evaluation.mode", "unknown value %d", e.GetMode())
	}
	if e.GetMode() != deltagymv1.VerifierMode_VERIFIER_MODE_PRISTINE {
		if proto.Equal(e, &deltagymv1.Evaluation{Mode: e.GetMode()}) {
			return nil
		}
		return badField("evaluation", "copy_paths, verifier_files, env, secret_options and the copy caps need mode VERIFIER_MODE_PRISTINE: elsewhere the agent's sandbox would see them")
	}
	if s.GetVerifier() == "" {
		return badField("evaluation.mode", "VERIFIER_MODE_PRISTINE needs a verifier")
	}
	if e.GetMaxCopyBytes() < 0 || e.GetMaxCopyEntries() < 0 {
		return badField("evaluation", "max_copy_bytes %d or max_copy_entries %d is negative", e.GetMaxCopyBytes(), e.GetMaxCopyEntries())
	}
	if err := validateVerifierVars(e); err != nil {
		return err
	}
	if f := e.GetVerifierFiles(); f != "" && (strings.ContainsRune(f, 0) || filepath.Clean(f) != f) {
		return badField("evaluation.verifier_files", "%q is not a clean path below the server's import root", f)
	}
	files := e.GetVerifierFilesPath()
	if files != "" && !cleanBelowRoot(files) {
		return badField("evaluation.verifier_files_path", "%q is not a clean absolute path below /", files)
	}
	if files == "" {
		files = DefaultVerifierFilesPath
	}
	return validateCopyPaths(e.GetCopyPaths(), files, e.GetVerifierFiles() != "")
}

// validateVerifierVars checks the verifier's environment and the secret options' names.
func validateVerifierVars(e *deltagymv1.Evaluation) error {
	for k, v := range e.GetEnv() {
		if k == "" || strings.ContainsAny(k, "=\x00") || strings.ContainsRune(v, 0) {
			return badField("evaluation.env", "variable %q is empty or holds '=' or NUL, or its value holds NUL", k)
		}
	}
	for i, o := range e.GetSecretOptions() {
		if !OptionKeyOK(o) {
			return badField(fmt.Sprintf("evaluation.secret_options[%d]", i), "%q is not a variable name (or uses the DELTAGYM_ prefix)", o)
		}
	}
	return nil
}

// validateCopyPaths checks copy paths: clean, absolute, below /, none inside another and none
// overlapping where the verifier files go (files) when there are some.
func validateCopyPaths(paths []string, files string, hasFiles bool) error {
	for i, p := range paths {
		field := fmt.Sprintf("evaluation.copy_paths[%d]", i)
		if !cleanBelowRoot(p) {
			return badField(field, "%q is not a clean absolute path below /", p)
		}
		if hasFiles && (within(p, files) || within(files, p)) {
			return badField(field, "%q overlaps evaluation.verifier_files_path %q", p, files)
		}
		for j, q := range paths[:i] {
			if within(p, q) || within(q, p) {
				return badField(field, "%q overlaps evaluation.copy_paths[%d] %q", p, j, q)
			}
		}
	}
	return nil
}

// cleanBelowRoot reports whether p is a clean absolute path other than / (at most 4096 bytes).
func cleanBelowRoot(p string) bool {
	return strings.HasPrefix(p, "/") && p != "/" && len(p) <= 4096 && !strings.ContainsRune(p, 0) && filepath.Clean(p) == p
}

// within reports whether path p is dir or below it.
func within(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }

// validateEgress checks the egress allow-list's entries and that its limits are numbers of
// their kind (Env.setEgress checks them against the server's).
func validateEgress(s *deltagymv1.EnvSpec) error {
	allow := s.GetEgress().GetAllow()
	if len(allow) > egress.MaxEntries {
		return badField("egress.allow", "%d entries, at most %d", len(allow), egress.MaxEntries)
	}
	for i, a := range allow {
		if _, err := egress.ParseEntry(a); err != nil {
			return badField(fmt.Sprintf("egress.allow[%d]", i), "%v", err)
		}
	}
	l := s.GetEgress().GetLimits()
	if l == nil {
		return nil
	}
	if len(allow) == 0 {
		return badField("egress.limits", "limits without an allow-list: the env's sandboxes have no egress to bound")
	}
	for _, f := range []struct {
		name string
		v    float64
	}{
		{"max_connections", float64(l.GetMaxConnections())}, {"connections_per_second", l.GetConnectionsPerSecond()},
		{"connection_burst", float64(l.GetConnectionBurst())}, {"max_bytes_up", float64(l.GetMaxBytesUp())},
		{"max_bytes_down", float64(l.GetMaxBytesDown())}, {"bytes_per_second_up", float64(l.GetBytesPerSecondUp())},
		{"bytes_per_second_down", float64(l.GetBytesPerSecondDown())}, {"idle_timeout_seconds", l.GetIdleTimeoutSeconds()},
	} {
		if !finiteNonNegative(f.v) {
			return badField("egress.limits."+f.name, "%v: a number from 0 (the server's limit) up", f.v)
		}
	}
	if t := l.GetIdleTimeoutSeconds(); t > maxEgressIdleSeconds {
		return badField("egress.limits.idle_timeout_seconds", "%v: at most %d", t, maxEgressIdleSeconds)
	}
	return nil
}

// maxEgressIdleSeconds bounds an env's egress idle timeout (a day).
const maxEgressIdleSeconds = 86400

func finiteNonNegative(v float64) bool { return v >= 0 && !math.IsNaN(v) && !math.IsInf(v, 0) }

// cloneSpec returns a deep copy, so callers cannot change a registered spec.
func cloneSpec(s *deltagymv1.EnvSpec) *deltagymv1.EnvSpec {
	return proto.Clone(s).(*deltagymv1.EnvSpec)
}
