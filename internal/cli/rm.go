package cli

import "errors"

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
	for _, n := range c.Names {
		if err := cl.Delete(g.Context(), n); err != nil {
			errs = append(errs, explain(err, g.socketPath()))
		}
	}
	return errors.Join(errs...)
}
