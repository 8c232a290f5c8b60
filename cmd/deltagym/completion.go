package main

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// completionScripts register the CLI's completion with each shell: the shell runs the binary
// with the command line in $COMP_LINE, and main answers through kongplete.
var completionScripts = map[string]string{
	"bash": "complete -C {{bin}} deltagym\n",
	"zsh":  "autoload -U +X bashcompinit && bashcompinit\ncomplete -C {{bin}} deltagym\n",
	"fish": `function __complete_deltagym
    set -lx COMP_LINE (commandline -cp)
    test -z (commandline -ct)
    and set COMP_LINE "$COMP_LINE "
    {{bin}}
end
complete -f -c deltagym -a "(__complete_deltagym)"
`,
}

// completionCmd prints a shell's completion script, to source from its startup file.
type completionCmd struct {
	Shell string `arg:"" enum:"bash,zsh,fish" help:"bash, zsh or fish"`
}

func (c *completionCmd) Help() string {
	return "Load it in the shell's startup file: source <(deltagym completion bash) in ~/.bashrc, " +
		"source <(deltagym completion zsh) in ~/.zshrc, deltagym completion fish | source in ~/.config/fish/config.fish."
}

func (c *completionCmd) Run(a *app) error {
	bin, err := os.Executable()
	if err != nil {
		return fmt.Errorf("finding this program's path: %w", err)
	}
	if bin, err = filepath.Abs(bin); err != nil {
		return fmt.Errorf("finding this program's path: %w", err)
	}
	_, err = fmt.Fprint(a.stdout, strings.ReplaceAll(completionScripts[c.Shell], "{{bin}}", shellQuote(bin)))
	return err
}
