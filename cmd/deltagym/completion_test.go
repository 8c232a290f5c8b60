package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// TestCompletionScript: `completion SHELL` prints a script that has the shell run this very
// binary to complete deltagym's command lines; bash takes its script.
func TestCompletionScript(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	self, _ = filepath.Abs(self)
	for shell, want := range map[string]string{
		"bash": "complete -C " + shellQuote(self) + " deltagym\n",
		"zsh":  "bashcompinit\ncomplete -C " + shellQuote(self) + " deltagym\n",
		"fish": "    " + shellQuote(self) + "\nend\ncomplete -f -c deltagym -a \"(__complete_deltagym)\"\n",
	} {
		stdout, stderr, code := runCLI(t, "", "completion", shell)
		if code != exitOK || !strings.HasSuffix(stdout, want) {
			t.Fatalf("completion %s: exit %d, stdout %q, stderr %q; want it to end with %q", shell, code, stdout, stderr, want)
		}
		if shell != "bash" {
			continue
		}
		bash, err := exec.LookPath("bash")
		if err != nil {
			t.Logf("no bash to load the script into: %v", err)
			continue
		}
		out, err := exec.Command(bash, "-c", stdout+"complete -p deltagym").CombinedOutput()
		if got := strings.TrimSpace(string(out)); err != nil || got != "complete -C "+self+" deltagym" && got != "complete -C '"+self+"' deltagym" {
			t.Fatalf("bash loaded the script as %q (%v), want it to run %s for deltagym", out, err, self)
		}
	}
}

// TestCompletion: with the command line in $COMP_LINE, as the shells run it, the CLI prints the
// words that may come next: commands, flags (serve's own included) and flag values, and exits 0
// without running anything.
func TestCompletion(t *testing.T) {
	tests := []struct {
		line string
		want []string
	}{
		{"deltagym re", []string{"read", "register-env", "release", "reset", "restore"}},
		{"deltagym reset shell --s", []string{"--seed"}},
		{"deltagym --ad", []string{"--addr"}},
		{"deltagym fork ck-1 --fr", []string{"--fresh-entropy"}},
		{"deltagym checkpoint sb --processes ", []string{"criu", "files", "template"}},
		{"deltagym import-image img x.tar --format ", []string{"docker", "oci", "rootfs"}},
		{"deltagym serve --lease", []string{"--lease-ttl"}},
		{"deltagym traj ", []string{"export"}},
		{"deltagym completion ", []string{"bash", "fish", "zsh"}},
	}
	for _, tt := range tests {
		t.Run(tt.line, func(t *testing.T) {
			t.Setenv("COMP_LINE", tt.line)
			t.Setenv("COMP_POINT", "")
			stdout, stderr, code := runCLI(t, "", "deltagym")
			got := strings.Fields(stdout)
			slices.Sort(got)
			if code != exitOK || !slices.Equal(got, tt.want) {
				t.Fatalf("completing %q: exit %d, %q (stderr %q); want %q", tt.line, code, got, stderr, tt.want)
			}
		})
	}
}
