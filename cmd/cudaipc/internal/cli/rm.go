package cli

import (
	"errors"
	"strings"
)

type rmCmd struct {
	Names []string `arg:"" help:"Objects to remove." placeholder:"NAME"`
}

func (c *rmCmd) Help() string {
	return "Removes objects. A name disappears at once; readers that hold a lease keep their bytes until they release it."
}

func (c *rmCmd) Run(g *Globals) error {
	cl, err := g.dial()
	if err != nil {
		return err
	}
	defer cl.Close()
	var errs []error
	var texts []string
	for _, n := range c.Names {
		if err := cl.Delete(g.Context(), n); err != nil {
			err = explain(err, g.socketPath())
			errs, texts = append(errs, err), append(texts, err.Error())
		}
	}
	if len(errs) == 0 {
		return nil
	}
	// One line for all of them (errors.Join would print one per line).
	return reword(errors.Join(errs...), "%s", strings.Join(texts, "; "))
}
