// Package archtest holds the tests of the project's shape: which packages may import which
// (docs/ARCHITECTURE.md, "Layers and dependencies"), and how large a type may grow.
package archtest

import (
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const module = "github.com/deltagym/deltagym"

// forbidden maps a package prefix (below the module) to the prefixes its packages must not
// import, directly or not: dependencies point proto → sandbox → envpool → server → cmd, and the
// clients and the load generator use only the generated API; the build's programs (scripts/)
// stand alone. The server alone speaks to other nodes (through the Go client's Cluster): the
// layers below it do not reach the Go client.
var forbidden = map[string][]string{
	"sandbox":   {"envpool", "server", "cmd", "loadtest", goClient},
	"envpool":   {"server", "cmd", "loadtest", goClient},
	"server":    {"cmd", "loadtest"},
	"loadtest":  {"sandbox", "envpool", "server", "cmd"},
	"internal/": {"sandbox", "envpool", "server", "cmd", "loadtest", goClient},
	"scripts/":  {"sandbox", "envpool", "server", "cmd", "loadtest", goClient},
}

// goClient is the Go client's package, in its own module below this one's path.
const goClient = "clients/go/deltagym"

type pkg struct {
	ImportPath string
	Deps       []string
}

func repoRoot(t *testing.T) string {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", ".."))
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// TestImportRules lists every package of the module with its dependencies (go list -deps) and
// checks the rules above.
func TestImportRules(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("needs the go command")
	}
	cmd := exec.Command("go", "list", "-json=ImportPath,Deps", "./...")
	cmd.Dir = repoRoot(t)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	dec := json.NewDecoder(strings.NewReader(string(out)))
	n := 0
	for dec.More() {
		var p pkg
		if err := dec.Decode(&p); err != nil {
			t.Fatal(err)
		}
		n++
		rel := strings.TrimPrefix(strings.TrimPrefix(p.ImportPath, module), "/")
		for from, nots := range forbidden {
			if !strings.HasPrefix(rel, from) {
				continue
			}
			for _, dep := range p.Deps {
				d, ok := strings.CutPrefix(dep, module+"/")
				if !ok {
					continue
				}
				for _, not := range nots {
					if d == not || strings.HasPrefix(d, not+"/") {
						t.Errorf("%s imports %s (%s must not depend on %s)", rel, d, from, not)
					}
				}
			}
		}
	}
	if n < 20 {
		t.Fatalf("go list found %d packages: the walk is broken", n)
	}
}

// maxFields is the most fields a struct type may have before it is split along its seams.
const maxFields = 30

// TestStructSize parses every non-test, non-generated Go file and checks that no struct type
// has more than maxFields fields.
func TestStructSize(t *testing.T) {
	root := repoRoot(t)
	fset := token.NewFileSet()
	checked := 0
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", ".cache", ".data", "bin", "gen", "node_modules":
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		f, err := parser.ParseFile(fset, p, src, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		if ast.IsGenerated(f) {
			return nil
		}
		checked++
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return true
			}
			fields := 0
			for _, fl := range st.Fields.List {
				fields += max(len(fl.Names), 1)
			}
			if fields > maxFields {
				rel, _ := filepath.Rel(root, p)
				t.Errorf("%s: struct %s has %d fields (at most %d: split it along its seams)", rel, ts.Name.Name, fields, maxFields)
			}
			return true
		})
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 50 {
		t.Fatalf("checked %d files: the walk is broken", checked)
	}
}
